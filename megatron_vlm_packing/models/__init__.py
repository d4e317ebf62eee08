"""Models: tiny GPT factories, the packed VLM adapter, vision towers."""
