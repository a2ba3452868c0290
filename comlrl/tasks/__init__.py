"""Ready workloads: data loaders, formatters, rewards and transitions built on the public API.

- :mod:`comlrl.tasks.code`: cooperative code generation (HumanEval), judged in :mod:`comlrl.sandbox`.
"""
