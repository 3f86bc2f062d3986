"""Runtime: scheduling, jitted step functions, sampling."""
