// Errors of the communication layer. A failure names the operation, the key or peer and the
// cause; a timed-out wait also names how long it waited. Catch CommError to catch both.
#pragma once

#include "tandem/core/error.h"

namespace tandem::dist {

// A peer could not be reached, refused us, broke the protocol or went away.
class CommError : public Error { using Error::Error; };
// A blocking wait (store get/wait, connect, collective) ran past its timeout.
class Timeout : public CommError { using CommError::CommError; };

}  // namespace tandem::dist
