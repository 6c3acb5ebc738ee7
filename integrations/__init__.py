"""kvproof inside serving engines (``kvproof.integrations``): one subpackage per engine."""
