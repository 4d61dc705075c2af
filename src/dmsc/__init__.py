"""dmsc."""
