"""The code that runs inside the sandbox's worker processes.

Standard library only (plus the optional ``pyseccomp`` and ``landlock`` packages), and no import of
``comlrl``: a worker is a fresh interpreter started with a minimal environment, which loads this
folder by path under the name ``comlrl_sandbox_runtime`` (see :mod:`comlrl.sandbox._worker`). The
training process imports :mod:`.codec` and :mod:`.frames` from here too.

Processes of one worker::

    zygote Z   (long-lived; pre-imported; namespaces set up once; a child subreaper)
      per request:
      init T   (first process of the request's PID namespace; forks and kills the program)
        program U   (untrusted: restricted, then runs the code or serves calls to its functions)
      judge J  (check only: runs the tests, calling U's functions over a pipe; reports to Z)
"""
