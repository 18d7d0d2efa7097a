"""Evaluation: the metrics of a policy on a split (`evaluate`) and their table and chart (`report`)."""
