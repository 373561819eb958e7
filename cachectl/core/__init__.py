"""Bottom layer: errors, units, settings, records and the one JAX seam; imports no other cachectl layer."""
