"""Inference on top of the single-device model."""
