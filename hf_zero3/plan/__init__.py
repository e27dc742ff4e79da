"""What fits: model shapes, the memory model (pure arithmetic) and the hardware it is asked about."""
