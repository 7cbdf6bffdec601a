"""Object stores: S3-compatible endpoints (``endpoint``), GCS (also in ``endpoint``),
Azure sources explained but not streamed (``azure``)."""
