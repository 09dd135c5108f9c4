"""The SPADE self-play loop: environment regeneration, agent plays, delayed designer rewards, GRPO steps, weight sync,
and checkpoints that resume exactly. ``spade-mega train CONFIG`` runs it; from Python,
``spade_mega.selfplay.loop.run(cfg)`` on every rank. ``state.py`` holds what a checkpoint saves besides the trainer's,
``batch.py`` how a rollout becomes optimizer steps.

Nothing is imported here: the ``spade-mega`` command imports ``selfplay.commands`` for every subcommand, and the loop
pulls in torch and Megatron-Core.
"""
