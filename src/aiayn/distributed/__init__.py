"""Processes and their faults: the process group, ranks and devices (env.py), preemption's
stop-after-an-agreed-step (preemption.py), what a fault is and whether a restart helps
(faults.py), the launcher that restarts faults only (run.py), excluding a failing node
(node_exclusion.py), one job per run directory (run_lock.py), workers that end with their
launcher (parent_death.py), and accelerate's launch options as overrides (launcher.py). The
model never imports this package."""
