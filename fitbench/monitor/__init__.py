"""Watching a job from the parent process: per-GPU timelines that outlive the job's ranks."""
