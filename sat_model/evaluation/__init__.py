"""Caption metrics, attention grounding, evaluation and visualisation."""
