"""Self-distillation data and Medusa head training."""
