"""Model families a stage worker can run, built from the spec the planner costs."""
