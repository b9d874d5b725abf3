"""Model families (one file each) and the registry that maps an architecture name to its class."""
