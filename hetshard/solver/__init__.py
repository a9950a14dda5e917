"""Plan builders and solvers."""
