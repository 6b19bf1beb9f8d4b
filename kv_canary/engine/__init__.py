"""What the canary runtime needs from a serving engine (`contract`)."""
