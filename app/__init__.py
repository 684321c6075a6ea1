"""HTTP API of the Jacobian service (FastAPI); never imports TensorFlow."""
