"""Pure arithmetic of the course: what collectives, tensor parallelism, memory and pipeline
bubbles cost. No torch, no processes: a test or a widget can call these directly."""
