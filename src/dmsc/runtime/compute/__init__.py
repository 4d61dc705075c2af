"""The computing-power layer: stage workers that run micro-models, and calibration."""
