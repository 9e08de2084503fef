/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import java.util.Arrays;
import java.util.Collections;
import java.util.HashSet;
import java.util.Set;

/**
 * An error raised by the native shuffle engine, or by the JVM glue around it.
 *
 * <p>The native library throws this class (with a {@link #kind()}) from every {@link NativeBridge}
 * method that fails; the JVM side never classifies errors by message text, only by kind.
 * Kinds are stable lower-case names. {@link #TRANSIENT_KINDS} and {@link #PERMANENT_KINDS} list
 * every kind the native side can send (a Rust test checks these lists against the engine's
 * failure codes and the bridge's error kinds, so the two sides cannot drift apart); a kind in
 * neither list is treated as permanent.
 * <ul>
 *   <li>transient: transport trouble or a momentary shortage that a retry may cure. Fetch
 *       failures of these kinds reach Spark as {@link java.io.IOException}, so Spark's own fetch
 *       retries ({@code spark.shuffle.io.maxRetries}, {@code spark.shuffle.io.retryWait}) apply
 *       before a {@code FetchFailedException};</li>
 *   <li>permanent: the server does not have the block, the data is corrupt, the peer refused
 *       {@code spark.authenticate}, a protocol violation, or bad settings (the message names the
 *       limit and the setting to change). Retrying would give the same answer.</li>
 * </ul>
 */
public class RdmaShuffleException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /**
   * Kinds a retry may cure: {@code connect}, {@code closed} (bridge), and the block failure
   * codes {@code io}, {@code timeout}, {@code peer_gone}, {@code pool_exhausted},
   * {@code pull_failed}.
   */
  public static final Set<String> TRANSIENT_KINDS = kinds(
      "connect", "closed", "io", "timeout", "peer_gone", "pool_exhausted", "pull_failed");

  /** Kinds a retry cannot cure (block failure codes, then the bridge's own kinds). */
  public static final Set<String> PERMANENT_KINDS = kinds(
      "unknown_shuffle", "unknown_map_output", "bad_range", "corrupt", "auth_refused", "protocol",
      "other", "config", "transport", "register", "invalid_argument", "jni", "internal");

  private static Set<String> kinds(String... names) {
    return Collections.unmodifiableSet(new HashSet<>(Arrays.asList(names)));
  }

  /** Kind used when the native side did not name one. */
  public static final String KIND_INTERNAL = "internal";

  private final String kind;

  /**
   * Creates an exception of a given kind.
   *
   * @param kind one of the kinds listed in the class documentation (null means "internal")
   * @param message what failed, with the context a user needs to act on it
   */
  public RdmaShuffleException(String kind, String message) {
    super(message);
    this.kind = kind == null ? KIND_INTERNAL : kind;
  }

  /**
   * Creates an exception of a given kind with a cause.
   *
   * @param kind one of the kinds listed in the class documentation (null means "internal")
   * @param message what failed
   * @param cause the underlying error
   */
  public RdmaShuffleException(String kind, String message, Throwable cause) {
    super(message, cause);
    this.kind = kind == null ? KIND_INTERNAL : kind;
  }

  /**
   * Constructor used by the native library, which only has a message at hand; the kind is
   * then "internal".
   *
   * @param message what failed
   */
  public RdmaShuffleException(String message) {
    this(KIND_INTERNAL, message);
  }

  /** @return the error kind (never null). */
  public String kind() {
    return kind;
  }

  /**
   * @return true for kinds a retry may cure (transport trouble), which Spark's retrying
   *     block transfer should see as an {@link java.io.IOException}.
   */
  public boolean isTransient() {
    return isTransientKind(kind);
  }

  /**
   * @param kind an error kind
   * @return whether that kind names transient transport trouble
   */
  public static boolean isTransientKind(String kind) {
    return TRANSIENT_KINDS.contains(kind);
  }

  @Override
  public String toString() {
    return getClass().getName() + "[" + kind + "]: " + getMessage();
  }
}
