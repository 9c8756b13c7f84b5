"""State sources: Kubernetes list+watch, or manifest files."""
