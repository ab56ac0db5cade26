"""Running configurations as SLURM jobs: their options (``options``), their batch scripts
(``script``), and the jobs once submitted (``jobs``).

SLURM's own commands (``sbatch``, ``squeue``, ``sacct``, ``scancel``), not submitit, because:

- the script that runs is the script a person reads: fitbench writes it as text, ``--dry-run``
  prints it, and a user may edit and submit it by hand; submitit writes its own script around a
  pickled Python callable, which a person can neither read nor submit without it;
- a job's ranks are torchrun agents started by ``srun``, one per node, each running
  ``fitbench.worker.worker`` as a command line; submitit starts one pickled function per task with
  its own environment for ``torch.distributed``, which torchrun's rendezvous and fitbench's worker
  would have to work around;
- submitit follows its jobs through ``sacct`` alone, which answers only where the cluster keeps
  accounting (slurmdbd); ``squeue`` answers everywhere for pending, running and recent jobs;
- the four commands are on every SLURM login node; nothing is added to fitbench's dependencies.
"""
