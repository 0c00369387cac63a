"""Helpers shared by the tests: reference readers and writers (``reference``), PLE checkpoints built
tensor by tensor (``hand_checkpoints``), the injected machines (``machines``), the C row copy driven
through ctypes (``rowcopy_jobs``)."""
