"""Serving: the plain-Python halves of the Triton models and the tritonserver launcher."""
