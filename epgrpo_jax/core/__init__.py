"""Pure functions of the method: the advantage equations, the losses, the optimizer."""
