"""What every stage stands on: the task (detection or segmentation, decided once), the ranks of a distributed run,
the distillation losses, per-layer output taps and the choices made on the select split. Imports no stage."""
