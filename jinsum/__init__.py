"""jinsum: indirect Einsums for JAX."""
