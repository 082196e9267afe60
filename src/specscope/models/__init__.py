"""Target model families (plain nn.Modules) and checkpoint loading."""
