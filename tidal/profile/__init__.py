"""Server profiles (JSON) and the cost model the planner and the simulator read from them."""
