"""Pass 3: from a Graph and a cost model, the solver problem; from its solution, a Plan."""
