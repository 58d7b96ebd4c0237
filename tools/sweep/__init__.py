"""``make sweep`` / ``make sweep-local``: a W&B grid sweep of one experiment, on W&B + Slurm or here, offline.

    python -m tools.sweep create --sweep NAME --exp EXP [--sweep-id ENTITY/PROJECT/ID] [--allow-infeasible]
                                 [--max-parallel N] [key=value ...]
    python -m tools.sweep local  --sweep NAME --exp EXP [key=value ...]

The sweep is ``experiments/sweeps/<NAME>.yaml`` in W&B's sweep format (``method: grid``, ``parameters`` of
``values`` / ``value``, a ``command`` with ``${args_no_hyphens}``). ``key=value`` overrides (make's ARGS) go to
every point, before the point's own. Before anything launches, every point is composed and validated
(:func:`run.compose.compose`) and planned on the experiment's device (:func:`planner.make_plan`); points that
fail either are listed with the reason instead of run.

``create`` uploads the sweep with ``wandb sweep`` (online; ``--sweep-id`` skips that and renders for an
existing sweep) and renders ``sweep.sbatch``, a Slurm job array with one ``wandb agent --count 1`` per point,
from ``experiments/slurm/sweep.sbatch`` with :mod:`tools.sbatch`'s pieces. ``local`` runs the same grid here,
one point after the other, each as the very command W&B's agent would run (the agent's own macro expansion,
``wandb.sdk.launch.sweeps.utils``) into ``<sweep dir>/<point>/``, then writes ``summary.csv``, ``summary.md``
and ``peak_memory.png`` there: per point the wake-window, rollout and train peaks and the KV cache, each
planned and measured alike (:func:`telemetry.memory_timeline.memory_figures`), the step time and the reward.

By concern: :mod:`tools.sweep.grid` (the sweep file, its grid, the sweep directory), :mod:`tools.sweep.points`
(every point composed and planned before launch), :mod:`tools.sweep.agent` (W&B glue: the agent's command
line, ``wandb sweep``), :mod:`tools.sweep.slurm` (``create``: the job array of agents), :mod:`tools.sweep.trial`
(one point run here and what its run directory measured), :mod:`tools.sweep.local` (``local``: every point,
then the summary), :mod:`tools.sweep.summary` (the table, CSV, markdown and plot), ``__main__`` (the command
line).
"""
