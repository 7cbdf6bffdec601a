"""Test-support helpers: fake S3, the tiny model, process-wide test hooks, disk scans."""
