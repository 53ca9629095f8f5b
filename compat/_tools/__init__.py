"""The tools around the library, apart from it: the command line, the benchmark table and
its workloads (shared with the asv suites), the demo, ``verify`` and the GPU check.
Nothing here is imported by the library itself."""
