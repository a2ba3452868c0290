"""Run untrusted Python (model-written code) in isolated, pre-forked processes.

    from comlrl.sandbox import Sandbox

    with Sandbox(timeout_s=5) as sandbox:
        sandbox.run("print(input()[::-1])", stdin="abc").stdout         # 'cba\\n'
        report = sandbox.check("def f(x):\\n    return 2 * x", ["assert f(2) == 4", "assert f(3) == 5"])
        report.passed, report.total                                     # (1, 2)
        sandbox.isolation()                                             # which layers are active here

Knows nothing of training; docs/code.md has the threat model and the isolation table.
"""

from ..exceptions import SandboxError
from ._results import RUN_STATUSES, TEST_STATUSES, ExecResult, TestReport, TestResult
from ._sandbox import LAYERS, Sandbox

__all__ = ["Sandbox", "ExecResult", "TestReport", "TestResult", "SandboxError", "LAYERS", "RUN_STATUSES",
           "TEST_STATUSES"]
