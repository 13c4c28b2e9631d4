"""Host half of in-region exclusivity: freeze siblings, isolate CPU cores, undo.

In: a region holder and its siblings as :class:`~krex.enforce.job.JobTarget`
(root process, process group, per-job cgroups, registered PIDs), the
:class:`~krex.enforce.enforcer.EnforceConfig` and the probed
:class:`~krex.enforce.cgroups.CgroupLayout`.
Out: an :class:`~krex.enforce.enforcer.Enforcement` whose ``exit()`` undoes
everything and returns the host part of the region report.

Modules: ``process`` (PID-reuse-safe handles), ``cgroups`` (layout, per-job
cgroups, sweep), ``job`` (a job's processes), ``operation`` (the undoable
operation shape), ``freeze`` (cgroup2 / cgroup1 / SIGSTOP), ``isolation``
(cpuset + per-thread affinity), ``undo`` (records the guardian replays),
``guardian`` (the process that undoes everything if the daemon dies),
``schedstat`` (holder counters: switches, migrations, CPU time, run delay),
``contention`` (was the holder preempted, by whom), ``enforcer`` (order, ExitStack,
report), ``doctor`` (what this machine supports).  See docs/enforce.md.
Imports stay lazy: the guardian process must start fast.
"""
