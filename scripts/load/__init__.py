"""Load tests and load generators: open and closed loop, overload, resenders, soak, Locust."""
