"""Launching a run: role placement checked against the parallel layout (``plan``), the sbatch script of a config
(``sbatch``), the wiring every process of a SLURM job starts through (``node``), and torchrun on this machine
(``local``). CLI: ``spade-mega launch slurm|local``."""
