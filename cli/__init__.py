"""Console entry points (click)."""
