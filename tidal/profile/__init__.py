"""`tidal profile`: measure one server's costs and model them for the planner and the simulator.

schema.py owns the JSON format (version 1, see docs/elasticity.md "Profile"), cost.py turns a
profile into `CostModel`, measure.py runs the measurement against a live server over HTTP.
data/ ships profiles measured on known hosts.
"""
