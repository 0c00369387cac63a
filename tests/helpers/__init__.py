"""Helpers shared by the tests: reference readers and writers (``reference``), the injected machines
(``machines``), the C row copy driven through ctypes (``rowcopy_jobs``)."""
