"""Bytes and paths, local or gs://: atomic writes and commits (`storage`), paths checked
before the work (`paths`), the one-run-at-a-time lock (`workdir_lock`) and the layout of a
run's work directory (`layout`). Imports nothing of the package but `errors`."""
