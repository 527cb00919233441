"""`tidal sim`: N simulated servers in virtual time, each step's cost from a `tidal profile` JSON.

- workload.py: the Azure trace replay and the phase-shifting mixes;
- instance.py: one server (live admission code, cost-model steps);
- engine.py: the event heap, routing (live `plan_route`), the planner (live `decide`), moves;
- report.py: SLO attainment, latencies, pools, moves (JSON) and the PNG;
- goodput.py: the highest rate meeting the SLOs, per layout (bisection);
- cli.py: the `tidal sim` command.
"""
