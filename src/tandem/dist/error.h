// Errors of the communication layer. A failure names the operation, the key or peer and the
// cause; a timed-out wait also names how long it waited. Catch CommError to catch both.
#pragma once

#include <string>

#include "tandem/core/error.h"

namespace tandem::dist {

// A peer could not be reached, refused us, broke the protocol or went away.
class CommError : public Error { using Error::Error; };
// A blocking wait (store get/wait, connect, collective) ran past its timeout.
class Timeout : public CommError { using CommError::CommError; };

// Throws `e`'s message followed by a line of `hint` (what the layer above knows about the likely
// cause), as a Timeout if `e` was one, else as a CommError.
[[noreturn]] inline void rethrow_with_hint(const CommError& e, const std::string& hint) {
  std::string msg = std::string(e.what()) + "\n" + hint;
  if (dynamic_cast<const Timeout*>(&e) != nullptr) throw Timeout(msg);
  throw CommError(msg);
}

}  // namespace tandem::dist
