"""Examples: a small real model (``examples.lm``) and the manifest that warms it."""
