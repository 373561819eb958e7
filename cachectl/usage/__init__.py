"""Usage layer: misses, advise and inventory, read from the telemetry the services recorded."""
