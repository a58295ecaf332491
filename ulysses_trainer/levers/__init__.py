"""Memory levers: each changes memory, never results."""
