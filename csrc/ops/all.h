// Every op family (one header each in csrc/ops/), for the tests that call their entries.
// The backends register them in units (ops/unit.h): csrc/cpu/register*.cpp,
// csrc/cuda/register*.cu.
#pragma once

#include "adam.h"
#include "lists.h"
#include "optimizers.h"
#include "unit.h"
