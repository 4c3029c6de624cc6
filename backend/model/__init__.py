"""Our Llama-family model over a flattened, unpadded batch, and the runner that executes a step."""
