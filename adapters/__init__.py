"""hybridcache subpackage."""
