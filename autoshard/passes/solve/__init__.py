"""The search: the CP-SAT planner (planner.py), the numbers its model is built from (solve_model.py) and
the bounds that prune layouts (bounds.py)."""
