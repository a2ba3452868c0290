"""The code that runs inside the sandbox's worker processes.

Standard library only (plus the optional ``pyseccomp`` package; Landlock is called directly), and
no import of ``comlrl``: a worker is a fresh interpreter started with a minimal environment, which
loads this folder by path under the name ``comlrl_sandbox_runtime`` (see
:mod:`comlrl.sandbox._worker`). The training process imports :mod:`.codec`, :mod:`.frames`,
:mod:`.cleanup`, :mod:`.cgroups` and :func:`.child.clean_text` from here too.

Processes of one worker::

    zygote Z   (long-lived; pre-imported; namespaces set up once; never reads a request)
      per request:
      handler H  (forked before the request arrives, waiting on a gate; reads this one request,
                  serves and answers it, exits; a child subreaper)
        init T   (first process of the request's PID, IPC and mount namespaces and the worker's
                  cgroup; forks and kills the program)
          program U   (untrusted: restricted, then runs the code or serves calls to its functions)
        judge J  (check only: runs the tests, calling U's functions over a pipe; reports to H)
"""
