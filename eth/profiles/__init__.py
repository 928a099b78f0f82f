"""Op costs of a model shape on a device type (docs/FORMATS.md, "Profile DB").

  db               the profile file format, look-up with mbs interpolation, analytic
                   (roofline) profiles, collective times (measured tables or alpha-beta)
  gemm_efficiency  the GEMM efficiency curve of analytic profiles
  gemm_fit         fitting that curve to measured GEMM times
  aceso            importing Aceso's profiling CSVs

Imports eth.spec.  Measured profiles are written by megatron.hpp.profiling.
"""
